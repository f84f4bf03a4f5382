"""One module per raw source type; each turns its input rows into samples for the builder."""
