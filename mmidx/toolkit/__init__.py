"""Tools around the pipeline: benchmarks, the demo, drawing packs, looking at samples, export."""
