"""Input and output beneath every stage: object storage, files, locks, system calls, the Ray cluster."""
