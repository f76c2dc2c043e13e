"""Decoding: what a request is (requests), how a token is chosen (sampling, constraints),
what a verify runs (tree, proposal: the data a proposer hands the step) and the step
itself (step: plan, propose, verify, accept, commit; verify: the one library call and what
each sequence keeps), and a request run alone (streaming).

Below speculation: the step calls a sequence's proposer through the interface that
decoding/proposal.py defines (Plan, Proposal, VerifiedStep) and never imports a speculation kind."""
