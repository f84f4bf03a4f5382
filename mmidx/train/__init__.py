"""Feeding a trainer: torch datasets and loaders with exact resume (a small state: the packs consumed, and the
stream they belong to), and the adapters that give other trainers (torchdata, DCP, Lightning, Accelerate,
torchtitan) packs and that state."""
