"""Layer utilities shared by the towers: attention, dropout, activation checkpointing, init, EMA."""
