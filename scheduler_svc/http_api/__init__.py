"""The OpenAI- and Anthropic-compatible HTTP API, served by the scheduler itself.

A thin translation: each route turns its JSON body into `GenerateRequest`s, admits
them through the same path as the gRPC servicer (scheduler_svc/admission.py) and
translates the token stream back into its API's responses or server-sent events.
"""
