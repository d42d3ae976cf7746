"""Prefect deployments: defined once in ``prefect.yaml``; ``deployments.serve`` runs them without a work pool."""
