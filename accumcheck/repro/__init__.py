"""Reproductions for bug reports: the request, the script's text, the shrinker."""
