"""Launchers: start the RM server and the PPO trainer together (``launchers.local``) and the
demo pipeline built on it."""
