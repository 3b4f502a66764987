"""Policies: the built-in tiny Llama and loading of models from disk."""
