"""The graph passes, in the order compiler/pipeline.py runs them."""
