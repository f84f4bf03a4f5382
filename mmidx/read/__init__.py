"""Reading datasets: random access by sample, the invariants their files must hold, verification."""
