"""Structured output: a request's constraint (core.Constraint) compiled to a grammar, and the per-request state
that turns it into token masks as the request advances (and along draft paths, rolled back after)."""
