"""Prefect tasks: thin, coarse wrappers that call one engine operation each and return small records."""
