"""transformers' own common model and config tests (ModelTesterMixin, ConfigTester), run against every NEZHA head.

The mixins are transformers' files for the installed version (see `transformers_common.py`); the tester
below follows the v4.39.3 NEZHA test the way v5's BERT test is written. Tests that cannot apply are
skipped with the reason in the skip message.
"""

import unittest

import pytest
import torch
import transformers_common

from nezha_hf import (
    NezhaConfig,
    NezhaForMaskedLM,
    NezhaForMultipleChoice,
    NezhaForNextSentencePrediction,
    NezhaForPreTraining,
    NezhaForQuestionAnswering,
    NezhaForSentenceExtraction,
    NezhaForSequenceClassification,
    NezhaForTokenClassification,
    NezhaForUniLM,
    NezhaModel,
)

modeling_common = transformers_common.load("test_modeling_common")
configuration_common = transformers_common.load("test_configuration_common")
ids_tensor, random_attention_mask = modeling_common.ids_tensor, modeling_common.random_attention_mask


@pytest.fixture(scope="module", autouse=True)
def nezha_in_transformers_name_tables():
    added = transformers_common.add_nezha_to_name_tables()
    yield
    for table in added:
        del table["nezha"]


class NezhaModelTester:
    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, use_input_mask=True,
                 use_token_type_ids=True, use_labels=True, vocab_size=99, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=37, hidden_act="gelu", hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1, max_position_embeddings=512, max_relative_position=3,
                 type_vocab_size=2, type_sequence_label_size=2, initializer_range=0.02, num_labels=3, num_choices=4):
        self.parent = parent
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, is_training
        self.use_input_mask, self.use_token_type_ids, self.use_labels = use_input_mask, use_token_type_ids, use_labels
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.intermediate_size, self.hidden_act = num_attention_heads, intermediate_size, hidden_act
        self.hidden_dropout_prob, self.attention_probs_dropout_prob = hidden_dropout_prob, attention_probs_dropout_prob
        self.max_position_embeddings, self.max_relative_position = max_position_embeddings, max_relative_position
        self.type_vocab_size, self.type_sequence_label_size = type_vocab_size, type_sequence_label_size
        self.initializer_range, self.num_labels, self.num_choices = initializer_range, num_labels, num_choices

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = random_attention_mask([self.batch_size, self.seq_length]) if self.use_input_mask else None
        token_type_ids = ids_tensor([self.batch_size, self.seq_length], self.type_vocab_size) if self.use_token_type_ids else None
        sequence_labels = token_labels = choice_labels = None
        if self.use_labels:
            sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
            token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
            choice_labels = ids_tensor([self.batch_size], self.num_choices)
        return self.get_config(), input_ids, token_type_ids, input_mask, sequence_labels, token_labels, choice_labels

    def get_config(self):
        return NezhaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act, hidden_dropout_prob=self.hidden_dropout_prob,
            attention_probs_dropout_prob=self.attention_probs_dropout_prob,
            max_position_embeddings=self.max_position_embeddings, max_relative_position=self.max_relative_position,
            type_vocab_size=self.type_vocab_size, is_decoder=False, initializer_range=self.initializer_range,
            num_labels=self.num_labels,
        )

    def sentence_ids(self):
        """A sentence index per token for NezhaForSentenceExtraction: three sentences, [CLS] and the last token none."""
        sentence = torch.arange(self.seq_length) * 3 // self.seq_length
        sentence[0] = sentence[-1] = -1
        return sentence.expand(self.batch_size, -1).clone()

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, token_type_ids, input_mask, *_ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": input_mask}

    def create_and_check_model(self, config, input_ids, token_type_ids, input_mask, *labels):
        model = NezhaModel(config).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids)
        result = model(input_ids, token_type_ids=token_type_ids)
        result = model(input_ids)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))
        self.parent.assertEqual(result.pooler_output.shape, (self.batch_size, self.hidden_size))

    def create_and_check_for_masked_lm(self, config, input_ids, token_type_ids, input_mask, sequence_labels,
                                       token_labels, choice_labels):
        model = NezhaForMaskedLM(config).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))

    def create_and_check_for_pretraining(self, config, input_ids, token_type_ids, input_mask, sequence_labels,
                                         token_labels, choice_labels):
        model = NezhaForPreTraining(config).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=token_labels,
                       next_sentence_label=sequence_labels)
        self.parent.assertEqual(result.prediction_logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        self.parent.assertEqual(result.seq_relationship_logits.shape, (self.batch_size, 2))

    def create_and_check_for_next_sequence_prediction(self, config, input_ids, token_type_ids, input_mask,
                                                      sequence_labels, token_labels, choice_labels):
        model = NezhaForNextSentencePrediction(config).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=sequence_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, 2))

    def create_and_check_for_question_answering(self, config, input_ids, token_type_ids, input_mask,
                                                sequence_labels, token_labels, choice_labels):
        config.num_labels = 2
        model = NezhaForQuestionAnswering(config).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids,
                       start_positions=sequence_labels, end_positions=sequence_labels)
        self.parent.assertEqual(result.start_logits.shape, (self.batch_size, self.seq_length))
        self.parent.assertEqual(result.end_logits.shape, (self.batch_size, self.seq_length))

    def create_and_check_for_sequence_classification(self, config, input_ids, token_type_ids, input_mask,
                                                     sequence_labels, token_labels, choice_labels):
        model = NezhaForSequenceClassification(config).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=sequence_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.num_labels))

    def create_and_check_for_token_classification(self, config, input_ids, token_type_ids, input_mask,
                                                  sequence_labels, token_labels, choice_labels):
        model = NezhaForTokenClassification(config).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.num_labels))

    def create_and_check_for_multiple_choice(self, config, input_ids, token_type_ids, input_mask, sequence_labels,
                                             token_labels, choice_labels):
        model = NezhaForMultipleChoice(config).eval()

        def expand(x):
            return x.unsqueeze(1).expand(-1, self.num_choices, -1).contiguous()

        result = model(expand(input_ids), attention_mask=expand(input_mask), token_type_ids=expand(token_type_ids),
                       labels=choice_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.num_choices))

    def create_and_check_for_unilm(self, config, input_ids, token_type_ids, input_mask, sequence_labels,
                                   token_labels, choice_labels):
        model = NezhaForUniLM(config).eval()
        source = (torch.arange(self.seq_length) < self.seq_length // 2).long()
        types = (1 - source).expand(self.batch_size, -1)
        result = model(input_ids, attention_mask=input_mask, token_type_ids=types, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        self.parent.assertTrue(torch.isfinite(result.loss))

    def create_and_check_for_sentence_extraction(self, config, input_ids, token_type_ids, input_mask,
                                                 sequence_labels, token_labels, choice_labels):
        model = NezhaForSentenceExtraction(config).eval()
        labels = ids_tensor([self.batch_size, 3], 2)
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids,
                       sentence_ids=self.sentence_ids(), labels=labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, 3))


class NezhaModelTest(modeling_common.ModelTesterMixin, transformers_common.GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (
        NezhaModel, NezhaForMaskedLM, NezhaForMultipleChoice, NezhaForNextSentencePrediction, NezhaForPreTraining,
        NezhaForQuestionAnswering, NezhaForSequenceClassification, NezhaForTokenClassification, NezhaForUniLM,
        NezhaForSentenceExtraction,
    )

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if model_class is NezhaForSentenceExtraction:
            inputs_dict["sentence_ids"] = self.model_tester.sentence_ids()
            if return_labels:
                inputs_dict["labels"] = torch.zeros(self.model_tester.batch_size, 3, dtype=torch.long)
        if model_class is NezhaForPreTraining and return_labels:
            inputs_dict["labels"] = torch.zeros(
                self.model_tester.batch_size, self.model_tester.seq_length, dtype=torch.long
            )
            inputs_dict["next_sentence_label"] = torch.zeros(self.model_tester.batch_size, dtype=torch.long)
        return inputs_dict

    def setUp(self):
        self.model_tester = NezhaModelTester(self)
        self.config_tester = configuration_common.ConfigTester(self, config_class=NezhaConfig, hidden_size=37)

    def test_config(self):
        # NezhaConfig() needs no arguments; hidden_size=37 above must pair with a head count it divides.
        self.config_tester.inputs_dict["num_attention_heads"] = 1
        self.config_tester.inputs_dict["hidden_size"] = 38
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_for_masked_lm(self):
        self.model_tester.create_and_check_for_masked_lm(*self.model_tester.prepare_config_and_inputs())

    def test_for_pretraining(self):
        self.model_tester.create_and_check_for_pretraining(*self.model_tester.prepare_config_and_inputs())

    def test_for_next_sequence_prediction(self):
        self.model_tester.create_and_check_for_next_sequence_prediction(*self.model_tester.prepare_config_and_inputs())

    def test_for_question_answering(self):
        self.model_tester.create_and_check_for_question_answering(*self.model_tester.prepare_config_and_inputs())

    def test_for_sequence_classification(self):
        self.model_tester.create_and_check_for_sequence_classification(*self.model_tester.prepare_config_and_inputs())

    def test_for_token_classification(self):
        self.model_tester.create_and_check_for_token_classification(*self.model_tester.prepare_config_and_inputs())

    def test_for_multiple_choice(self):
        self.model_tester.create_and_check_for_multiple_choice(*self.model_tester.prepare_config_and_inputs())

    def test_for_unilm(self):
        self.model_tester.create_and_check_for_unilm(*self.model_tester.prepare_config_and_inputs())

    def test_for_sentence_extraction(self):
        self.model_tester.create_and_check_for_sentence_extraction(*self.model_tester.prepare_config_and_inputs())
