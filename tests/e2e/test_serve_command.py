"""The README's first command: `swarmserve serve` brings up both services on the embedded
model, says where they listen, serves, and stops both cleanly on Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from clients import SwarmClient
from tests.support.stack import ROOT, free_port


def test_serve_starts_both_services_answers_and_stops_cleanly():
    executor, scheduler, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clients.cli",
            "serve",
            "--executor-listen",
            executor,
            "--scheduler-listen",
            scheduler,
            "--http-listen",
            http,
            "--kv-cache-gb",
            "0.1",
        ],  # fmt: skip
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        banner = ""
        deadline = time.monotonic() + 180
        while f"http://{http}/v1" not in banner and time.monotonic() < deadline and proc.poll() is None:
            banner += proc.stdout.readline()
        assert executor in banner and scheduler in banner and f"http://{http}/v1" in banner, banner
        with SwarmClient(scheduler) as client:
            completion = client.complete("The capital of France is", max_new_tokens=5, temperature=0.0, ignore_eos=True)
        assert len(completion.token_ids) == 5
        reply = httpx.post(
            f"http://{http}/v1/completions", json={"model": "m", "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}, timeout=60
        ).json()  # fmt: skip
        assert reply["choices"][0]["text"] == completion.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # Both children are gone: their ports are free again.
    for address in (executor, scheduler, http):
        import socket

        host, port = address.rsplit(":", 1)
        with socket.socket() as s:
            s.bind((host, int(port)))
