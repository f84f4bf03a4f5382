"""Feeding a trainer: torch datasets and loaders with exact resume, and trainer adapters."""
