"""Integrations with the training frameworks users already run: `transformers.Trainer`
(gemini_ext.integrations.transformers.GeminiTrainer) and `lightning.pytorch`
(gemini_ext.integrations.lightning.GeminiStrategy). Each imports its framework only when it is
imported."""
