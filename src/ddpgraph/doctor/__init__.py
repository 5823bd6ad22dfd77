"""Diagnostics: ``lint`` (static checks of a script) and ``env`` (environment report and live
self-test). This package is on the CLI side: the core never imports it."""
