// llama_cpp_logits MODEL.gguf OUT.bin ID,ID,...: feed the ids to llama.cpp one token per
// decode call (KV cache in f32) and write every position's logits as float32 rows to OUT.bin.
// Built and run by benchmarks/llama_cpp_diff.py.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <string>
int main(int argc, char** argv) {
    if (argc < 4) { fprintf(stderr, "usage: logits model.gguf out.bin id,id,...\n"); return 2; }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model* model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    std::vector<llama_token> ids;
    std::string s = argv[3];
    size_t p = 0;
    while (p < s.size()) { size_t q = s.find(',', p); if (q == std::string::npos) q = s.size(); ids.push_back(atoi(s.substr(p, q - p).c_str())); p = q + 1; }
    llama_context_params cp = llama_context_default_params();
    cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
    cp.n_ctx = 4096; cp.n_batch = 4096; cp.n_ubatch = 4096; cp.n_threads = 2;
    llama_context* ctx = llama_init_from_model(model, cp);
    const llama_vocab* vocab = llama_model_get_vocab(model);
    int nv = llama_vocab_n_tokens(vocab);
    FILE* f = fopen(argv[2], "wb");
    for (size_t i = 0; i < ids.size(); ++i) {
        llama_batch b = llama_batch_get_one(&ids[i], 1);
        if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed at %zu\n", i); return 1; }
        fwrite(llama_get_logits_ith(ctx, -1), sizeof(float), nv, f);
    }
    fclose(f);
    fprintf(stderr, "wrote %zu x %d logits\n", ids.size(), nv);
    return 0;
}
