"""Logs (and later traces and metrics) for both services.

It lives here because the executor package is the one both services already
share a dependency direction with; nothing in it imports torch.
"""
