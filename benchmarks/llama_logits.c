/* The logits llama.cpp computes for one sequence, for benchmarks/llama_cpp.py's "logits err".
 *
 * usage: llama-logits MODEL.gguf THREADS < token ids (whitespace-separated) > logits
 * Decodes the ids as one batch (one sequence from position 0, no BOS added) with every
 * position's logits kept, and writes them to stdout as float32, n_tokens × n_vocab, row-major.
 * Built by llama_cpp.py against the checkout's include/ and build/bin/libllama.so. */
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *data) {
    (void)data;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS < token ids > logits\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model *model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == NULL) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    int capacity = 4096, n = 0;
    llama_token *ids = malloc(sizeof *ids * capacity);
    while (n < capacity && scanf("%d", &ids[n]) == 1) n++;
    struct llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = (uint32_t)n;
    cparams.n_threads = cparams.n_threads_batch = atoi(argv[2]);
    struct llama_context *ctx = llama_init_from_model(model, cparams);
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = ids[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (ctx == NULL || n == 0 || llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "llama_decode failed on %d tokens\n", n);
        return 1;
    }
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), (size_t)vocab, stdout);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(ids);
    return 0;
}
