"""transformers glue: the generate() wrapper, input validation, SSDConfig Hub I/O, the custom_generate writer."""
