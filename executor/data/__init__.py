"""Training data: datasets the runtime reads and ``ptplan data``'s preparation of text files."""
