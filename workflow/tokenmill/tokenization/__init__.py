"""Stage 2, tokenize: the target model's tokenizer and chat template turn prompts into ids."""
