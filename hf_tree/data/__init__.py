"""Datasets: offline converters of packaged data and the project's own seeded generators."""
