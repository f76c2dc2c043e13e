"""The engine: options settled into a setup (setup, args), the models loaded within the
devices' memory (memory, loading), each slot's context between requests (slots), and the
Engine users script (engine)."""
