"""Data: ShareGPT records, chat-templated conversations, self-distillation and relabelling."""
