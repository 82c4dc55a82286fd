"""Task definitions (data, prompts, answer extraction, scoring) behind the quality runners."""
