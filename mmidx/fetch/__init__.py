"""Downloading images from URL tables: the async fetcher, its outcome classes and the per-row fetch ledger."""
