"""The pieces of `examples/train_lm.py`: data, model, recipes, training loop, reporting."""
