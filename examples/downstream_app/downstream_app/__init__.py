"""A stand-in for an application that uses SageAttention (see attention.py)."""
