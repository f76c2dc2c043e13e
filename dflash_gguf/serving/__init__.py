"""dflash-server: the HTTP application (routes), its scheduler over one Engine
(scheduler), the OpenAI and Anthropic request models and replies, and llama-server's
error shapes."""
