"""Reports of runs and experiments: data loading, plots, statistics."""
