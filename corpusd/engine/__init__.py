"""Pins made by a serving engine (``corpusd pin --engine``): SGLang prefills, corpusd stores."""
