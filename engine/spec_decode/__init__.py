"""Speculative decoding: proposers of draft tokens and their lossless verification.

The scheduler treats drafts as more tokens a request lacks; the model runner verifies them
in the target's step (`rejection_sampler`) and asks a proposer for the next ones: the
`ngram` prompt lookup or a `draft_model`.
"""
