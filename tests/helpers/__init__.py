"""The helpers the test modules of tests/<layer>/ share: fixtures' checkpoint builders,
oracles and checks, and the workers some tests run as processes (imported as `helpers.<module>`)."""
