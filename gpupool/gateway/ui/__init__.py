"""The pool page (``GET /ui``): static files served by the gateway, fed by one admin event stream.

``feed.py`` builds what the page shows from the registry, admission and metrics, and keeps the
small bounded histories (errors, state changes, reloads, tokens/s) that those do not keep; it
imports no web framework. ``gateway/api/ui_routes.py`` serves the files and the stream.
"""
