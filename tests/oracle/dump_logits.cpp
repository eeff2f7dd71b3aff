// llama.cpp's logits of a vocabulary-less GGUF on given token ids: the DUMP_LOGITS driver of
// make_gemma4.py (its `llama_logits()` reads the output).
//
// usage: dump_logits MODEL.gguf OUT.f32 MODE IDS
//   MODE  "full": every token in one batch; "incr:N": the first N tokens in one batch, then
//         the rest one at a time on the cache.
//   IDS   comma-separated token ids.
// OUT.f32: raw little-endian f32 logits [n_tokens, n_vocab], one row per position.
//
// Build against llama.cpp (the source in the llama-cpp-python sdist's vendor/llama.cpp), CPU
// only, e.g.:
//   cmake -S llama.cpp -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
//   cmake --build build --target llama llama-quantize -j2
//   g++ -O2 -std=c++17 dump_logits.cpp -I llama.cpp/include -I llama.cpp/ggml/include \
//     build/src/libllama.a build/ggml/src/libggml.a build/ggml/src/libggml-cpu.a \
//     build/ggml/src/libggml-base.a -fopenmp -lpthread -o dump_logits
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void die(const char * what) {
    fprintf(stderr, "dump_logits: %s\n", what);
    exit(1);
}

// Decode `toks[from..to)` at positions from..to with logits for every row; append them.
static void run(llama_context * ctx, const std::vector<llama_token> & toks, int from, int to, int n_vocab,
                std::vector<float> & out) {
    const int n = to - from;
    llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i]     = toks[from + i];
        b.pos[i]       = from + i;
        b.n_seq_id[i]  = 1;
        b.seq_id[i][0] = 0;
        b.logits[i]    = 1;
    }
    b.n_tokens = n;
    if (llama_decode(ctx, b) != 0) {
        die("llama_decode failed");
    }
    for (int i = 0; i < n; i++) {
        const float * l = llama_get_logits_ith(ctx, i);
        if (!l) {
            die("no logits");
        }
        out.insert(out.end(), l, l + n_vocab);
    }
    llama_batch_free(b);
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        die("usage: dump_logits MODEL.gguf OUT.f32 full|incr:N ID,ID,...");
    }
    std::vector<llama_token> toks;
    for (const char * p = argv[4]; *p;) {
        char *     end;
        const long v = strtol(p, &end, 10);
        if (end == p) {
            die("bad token list");
        }
        toks.push_back((llama_token) v);
        p = *end == ',' ? end + 1 : end;
    }
    const int t      = (int) toks.size();
    const std::string mode = argv[3];
    int       prefill = t;
    if (mode.rfind("incr:", 0) == 0) {
        prefill = atoi(mode.c_str() + 5);
    } else if (mode != "full") {
        die("mode is full or incr:N");
    }
    if (t == 0 || prefill <= 0 || prefill > t) {
        die("bad token count or prefill");
    }

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers       = 0;
    llama_model * model   = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        die("cannot load the model");
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx                = (uint32_t) t + 16;
    cp.n_batch              = (uint32_t) t;
    cp.n_ubatch             = (uint32_t) t;
    cp.n_seq_max            = 1;
    cp.n_threads            = 2;
    cp.n_threads_batch      = 2;
    llama_context * ctx     = llama_init_from_model(model, cp);
    if (!ctx) {
        die("cannot make a context");
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    if (n_vocab <= 0) {
        die("the model reports no vocabulary size");
    }

    std::vector<float> out;
    run(ctx, toks, 0, prefill, n_vocab, out);
    for (int i = prefill; i < t; i++) {
        run(ctx, toks, i, i + 1, n_vocab, out);
    }
    FILE * f = fopen(argv[2], "wb");
    if (!f || fwrite(out.data(), sizeof(float), out.size(), f) != out.size() || fclose(f) != 0) {
        die("cannot write the output");
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
