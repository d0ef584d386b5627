"""The rules: each turns one tick's snapshot and windows into conditions."""
