"""Speculation: who proposes drafts and how large. The proposers (a drafter's chain or
DDTree, draft-simple's small model, the weightless n-gram and suffix kinds, plain), the
DDTree builder, `auto` (the cost model that prices each step: auto, pricing, verify_cost,
auto_store) and the choice of a proposer for a request (choice).

Over the runtime and decoding layers; nothing below imports it."""
