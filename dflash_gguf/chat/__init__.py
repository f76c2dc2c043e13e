"""Chat formats: the GGUF's templates, reasoning and tool calls read from a reply as it
streams, OpenAI's Harmony format, and the grammars that constrain tool calls. Over the
decoding layer (constraints, stream text) only."""
