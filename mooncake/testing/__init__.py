"""Harnesses users run against their own deployments and code (conformance suites)."""
