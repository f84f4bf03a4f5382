"""``mmidx view``: a local, read-only web viewer of datasets, their distributions and their packs."""
