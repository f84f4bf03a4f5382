"""Feeding a trainer: torch datasets and loaders with exact resume (one global integer), and the adapters
that give other trainers (torchdata, DCP, Lightning, Accelerate, torchtitan) packs and that state."""
