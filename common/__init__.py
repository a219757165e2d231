"""Shared, unit-tested building blocks of the RL-for-flow-matching scripts."""
