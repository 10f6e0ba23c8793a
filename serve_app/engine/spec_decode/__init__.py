"""Speculative decoding: proposers, the acceptance rule and the adaptive choice of k."""
