"""Integrations with the training frameworks users already run: `transformers.Trainer`
(gemini_ext.integrations.transformers). Each imports its framework only when it is imported."""
