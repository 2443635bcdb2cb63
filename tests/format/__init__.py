"""What is stored, as bytes: chunks, keys, layouts, codecs, and a reader written from docs/FORMAT.md."""
