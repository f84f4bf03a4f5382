"""Adapters that give trainers (torchdata, DCP, Lightning, Accelerate, torchtitan) packs and one-integer state."""
