"""fedhet: federated learning under data heterogeneity."""
__version__ = "0.1.0"
