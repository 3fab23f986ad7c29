"""Readout workers: verify, claim, read the whole answer in one decoder execution, commit."""
