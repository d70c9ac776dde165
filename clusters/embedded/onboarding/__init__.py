"""The reference platform's namespace onboarding (see README.md)."""
