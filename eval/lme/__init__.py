"""LongMemEval-V2 harness: data, memory modules, reader, scoring, LAFS (../shared/reference/lme-v2.md)."""
