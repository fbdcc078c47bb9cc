"""Drafter training (spec section 9)."""
