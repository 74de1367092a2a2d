"""The optional hidden_states stage: the target model's hidden states of every kept row."""
